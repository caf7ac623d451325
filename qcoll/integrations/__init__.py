"""qcoll in the training stacks users already run. ``qcoll.integrations.hf``: the Hugging Face
``Trainer`` (through Accelerate's FSDP2 support) gets qcoll's quantized comms from a callback."""
