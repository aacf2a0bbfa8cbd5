"""Proposers: where draft tokens come from."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "HybridProposer", "NgramProposer", "Proposal", "Proposer"]
