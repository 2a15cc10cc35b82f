"""The lessons' applications: SmolLM2 and MRPC (offline fallbacks included), the training script and its resume."""
