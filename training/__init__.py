"""Training of selfdraft drafters: prompt sets and self-distillation data (`data`), divergences
between drafter and target distributions (`losses`), the training loop (`trainer`) and the
`selfdraft` command line (`cli`)."""
