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
