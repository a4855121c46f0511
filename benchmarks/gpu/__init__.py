"""The GPU check's parts: FLOP accounting, inputs, timed runs of lychee_exp and of HF Trainer + peft."""
