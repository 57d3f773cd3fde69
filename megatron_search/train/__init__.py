"""The training loops (SFT, GRPO) and the embedded demo, on the trainer core (trainer/)."""
