"""Proposers: where draft tokens come from."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.head import HeadProposer, HeadTreeProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer

# The names the CLI and the API accept, and how each is built: specdec.speculation.METHODS.

__all__ = ["DraftModelProposer", "HeadProposer", "HeadTreeProposer", "HybridProposer", "NgramProposer",
           "Proposal", "Proposer", "SuffixProposer"]
