"""Importers of published looped LMs (issue 14 §2): ``looplm import huginn|ouro SRC --out DIR`` maps every tensor
of a downloaded Hugging Face folder onto a looplm checkpoint (coverage checked both ways, errors naming the key).
Layouts: ``docs/importers-layout.md``; usage and parity: ``docs/importers.md``. Imports no torch.
"""
