"""LoRA adapters: PEFT checkpoints read and checked (`adapter`), a fixed pool of adapter weights beside the
base model's linear layers (`pool`), and which adapters are served, loaded and in a pool slot, with each
step's rows grouped by slot (`manager`)."""
