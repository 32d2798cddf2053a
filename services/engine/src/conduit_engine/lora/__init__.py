"""LoRA adapters: PEFT checkpoints read and checked (`adapter`), a fixed pool of adapter weights beside the
base model's linear layers (`pool`), which adapters are loaded and which hold a pool slot (`manager`), and
one step's rows grouped by adapter (`batch`)."""
