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

# Random digits (seed 2026): most pairs of digits occur in the prompt, so a lookup proposer
# drafts at most steps, and the target's next digit is uncertain, so many drafts are rejected.
# `specdec verify`'s law test needs both: drafts to verify, and rejections for its negative
# control (a wrong residual) to show. On the copying prompt above the lookup's drafts are
# accepted ~99% of the time and the control cannot be told apart.
DIGITS_PROMPT = ("Continue this list of random digits:\n"
                 "1 5 8 8 1 3 9 9 8 6 9 8 7 9 7 3 0 9 1 1 4 1 7 0 7 5 3 6 4 5 5 6 8 1 5 1 8 8 4 4 7 2 9 4 0 5 5 7 "
                 "6 1 6 9 8 7 1 6 8 9 7 6 8 4 6 9 7 8 8 0")  # short: the law test prefills it once per sample
