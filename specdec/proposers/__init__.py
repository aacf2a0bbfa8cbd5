"""Proposers: where draft tokens come from."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.head import HeadProposer, HeadTreeProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer

# The names the CLI and the API accept; "none" is plain decoding. Tree proposers: "suffix",
# "head-tree" and "hybrid-tree" (suffix lookup when the text repeats itself, else head trees).
PROPOSERS = ("head", "draft", "ngram", "early-exit", "hybrid", "hybrid-head", "suffix", "head-tree", "hybrid-tree", "none")

__all__ = ["PROPOSERS", "DraftModelProposer", "HeadProposer", "HeadTreeProposer", "HybridProposer", "NgramProposer",
           "Proposal", "Proposer", "SuffixProposer"]
