"""The routing key of a prompt: its leading text (or token ids), which prefix_affinity hashes."""

from __future__ import annotations

from conduit.engine.v1 import engine_pb2

# A token is about four characters, so a token-id prompt uses a quarter as many ids as text uses characters.
CHARS_PER_TOKEN = 4


def prefix_key(request: engine_pb2.GenerateRequest, chars: int) -> bytes:
    """The first `chars` characters of the prompt as the engine will see it, as bytes.

    Chat messages are joined as role and content with separators that text cannot contain, so two
    conversations with the same opening messages (the usual shared system prompt) get the same key. The
    input kind is part of the key: text and token ids of one prompt never share cache blocks anyway.
    """
    kind = request.WhichOneof("input")
    if kind == "text":
        return b"t\x00" + request.text[:chars].encode("utf-8", "surrogatepass")
    if kind == "token_ids":
        ids = request.token_ids.ids[: max(1, chars // CHARS_PER_TOKEN)]
        return b"i\x00" + b"".join(token.to_bytes(4, "little") for token in ids)
    if kind == "chat":
        parts = [f"{message.role}\x1f{message.content}" for message in request.chat.messages]
        return b"c\x00" + "\x1e".join(parts)[:chars].encode("utf-8", "surrogatepass")
    return b""
