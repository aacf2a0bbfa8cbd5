"""Small built-in prompt sets for the benchmark scripts (the full suite lives in bench workloads)."""

CODE_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Implement binary search over a sorted list in Python and return the index or -1.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a function that parses a CSV line with quoted fields into a list of strings, in Python.",
]


# A prompt whose continuation copies its own earlier text: the lookup proposers (n-gram, suffix,
# the hybrids' lookup side) draft from it at once, so `specdec verify` tests them with drafts.
COPY_PROMPT = ("Copy the list below exactly, then stop.\n"
               "List: apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum, quince, raspberry\n"
               "Copy: apple, banana, cherry, grape, lemon,")

# Two symbols in an irregular order: every bigram repeats, so a lookup proposer drafts at every
# step, and the target's next symbol is uncertain (smollm2-135m at T=0.8, top-3: p(" a") ~0.6-0.7,
# p(" b") ~0.2-0.3 at each of the first 4 tokens), so drafts lie inside the target's support with
# 0 < p < 1 and about half are rejected. `specdec verify`'s law test needs exactly that: on the copying
# prompt above the lookup's drafts are accepted ~99% of the time, and on a list of random digits
# they fall outside the top-k (p = 0, where the right and the wrong residual coincide), so in both
# cases its negative control (a wrong residual) cannot be told apart.
BRANCH_PROMPT = "a b a b b a b a a b a b b a b"  # short: the law test prefills it once per sample


# The methods that draft by looking the text up (alone or inside a hybrid).
LOOKUP_METHODS = ("ngram", "suffix", "hybrid", "hybrid-tree", "hybrid-head")


def verify_prompts(lookup: bool) -> list[str]:
    """The built-in prompts of `specdec verify` and `specdec profile`, in order. The law test samples
    the FIRST prompt's continuation, so a lookup method starts with BRANCH_PROMPT (drafts at every
    step, inside the target's support, about half rejected: the negative control can show); the
    copying prompt exercises long accepted drafts in the greedy identity check."""
    if lookup:
        return [BRANCH_PROMPT, *CODE_PROMPTS, COPY_PROMPT]
    return [*CODE_PROMPTS, COPY_PROMPT, BRANCH_PROMPT]
