"""The run layer, below ``train/``, ``distill/``, ``rl/`` and ``eval/``: atomic checkpoint I/O (:mod:`.checkpoint`),
Hugging Face export folders read without transformers (:mod:`.hf_folder`), the run-folder lock (:mod:`.lock`), the
process group and sharded state (:mod:`.dist`, the only ``torch.distributed`` code)."""
