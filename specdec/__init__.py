"""specdec: exact speculative decoding — library, CLI and server."""

from specdec.verify.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify.tree import TreeVerification, verify_tree
from specdec.verify.chain import ChainVerification, verify_chain

__all__ = ["ChainVerification", "SamplingParams", "TreeVerification", "probs_from_logits", "sample", "verify_chain",
           "verify_tree"]
__version__ = "0.1.0"
