"""Finite-state Markov target/draft pairs: the seed experiment and its closed form."""

from specdec.toy.markov import SEED_DRAFT, SEED_TARGET, MarkovPair, closed_form
from specdec.toy.experiment import ToyResult, run_fast, run_reference

__all__ = ["SEED_DRAFT", "SEED_TARGET", "MarkovPair", "ToyResult", "closed_form", "run_fast", "run_reference"]
