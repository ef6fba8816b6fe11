"""LoRA adapters served beside the base model, several in one batch: request.py names
one (LoRARequest), adapter.py reads PEFT's files into the engine's module layout,
layers.py adds each row's adapter delta in the projections, slots.py decides which
adapters hold the model's slots."""
