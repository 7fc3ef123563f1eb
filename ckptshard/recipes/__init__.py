"""Recipes shipped with ckptshard, as examples and as verify-resume's built-in runs (docs/recipes.md).

Internal as Python modules: name them by spec (``ckptshard.recipes.vissl_like:RECIPE``) on the command line
or to ``ckptshard.verify_resume``; copy one to start your own.

``vissl_like``: a VISSL-style trunk and SwAV head under fairscale FSDP, in
four variants (``RECIPE`` fp32, ``MIXED``, ``FROZEN``, ``GROUPS``).
``transformer``: a small tied-embedding language model under fairscale FSDP.
``verl_fsdp2``: a tied-embedding language model under torch ``fully_shard``,
saved as verl saves it.
"""
