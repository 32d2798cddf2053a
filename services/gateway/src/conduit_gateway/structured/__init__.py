"""Structured outputs and tools on the request side: which constraint a request sets (response_format,
structured_outputs, guided_*, or the tool-call schema of tool_choice required/named), its checks, and its
place in SamplingParams. The engine enforces the constraint; the gateway refuses what it can see is wrong."""
