"""Proposers: where draft tokens come from."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.head import HeadProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer

# The names the CLI and the API accept; "none" is plain decoding.
PROPOSERS = ("head", "draft", "ngram", "early-exit", "hybrid", "hybrid-head", "none")

__all__ = ["PROPOSERS", "DraftModelProposer", "HeadProposer", "HybridProposer", "NgramProposer", "Proposal", "Proposer"]
