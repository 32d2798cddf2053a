"""Speculative decoding: proposals that the target model verifies several at a time (plain Python, no
torch): the configuration (`config`), the n-gram prompt-lookup proposer (`ngram`) and the per-sequence
acceptance bookkeeping that switches a sequence's speculation off when it does not pay (`tracker`)."""
