"""The gateway's side of the engine contract: channels, health, model info and engine selection."""
