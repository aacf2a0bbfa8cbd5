"""Proposers: where draft tokens come from."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer

PROPOSERS = ("draft", "ngram", "early-exit", "hybrid")  # the names the CLI and the API accept

__all__ = ["PROPOSERS", "DraftModelProposer", "HybridProposer", "NgramProposer", "Proposal", "Proposer"]
