"""Token sampling: per-step metadata, logit processors, truncation, random selection and logprobs.

The plain-Python parts (`plan`, `seeds`, `token_logprobs`) load no torch; import each module itself.
"""
