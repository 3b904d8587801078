"""Write a looplm checkpoint that has Huginn-0125's architecture in the published Huginn-0125 layout (config.json,
model.safetensors with the original tensor names and freqs_cis, tokenizer.json), so that `looplm import huginn`
can read it: `python experiments/import/to_huginn_layout.py CHECKPOINT OUT_FOLDER`.

The folder's mean_recurrence is the checkpoint's nominal training depth. See README.md in this folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from looplm.eval.runner import load_tokenizer_for
from looplm.importers.huginn import write_huginn_folder
from looplm.run.checkpoint import load_checkpoint


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    model, cfg, _, ckpt = load_checkpoint(argv[0])
    depth = cfg.depth.nominal_depth()
    out = write_huginn_folder(model, load_tokenizer_for(ckpt).to_str(), Path(argv[1]), depth=depth)
    print(f"wrote {out} (mean_recurrence {depth})")


if __name__ == "__main__":
    main(sys.argv[1:])
