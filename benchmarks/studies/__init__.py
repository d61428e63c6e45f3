"""One-off studies whose question is answered: each folder holds the script, its result and a README
(the question, the answer, how to rerun it)."""
