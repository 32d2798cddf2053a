"""Pydantic models of the OpenAI request and response shapes the gateway speaks."""
