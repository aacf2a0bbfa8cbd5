"""specdec: exact speculative decoding — library, CLI and server."""

from specdec.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify import ChainVerification, verify_chain

__all__ = ["ChainVerification", "SamplingParams", "probs_from_logits", "sample", "verify_chain"]
__version__ = "0.1.0"
