"""``tools/checkpoint.py``: look at, compare and convert checkpoints offline, on one CPU process.

Subcommands (one module each): ``inspect`` (``inspect_cmd``), ``diff`` (``diff_cmd``) and ``convert``
(``convert_cmd``: to and from Hugging Face ``transformers`` directories). ``reader`` opens one of our
checkpoints and reads its tensors one at a time, whatever layout saved them.
"""
