"""Proposers: where draft tokens come from."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer

__all__ = ["DraftModelProposer", "Proposal", "Proposer"]
