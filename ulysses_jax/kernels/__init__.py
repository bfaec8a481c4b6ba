"""Pallas kernels; they import nothing from the rest of the package.

Import from the module (``from ulysses_jax.kernels.flash_attention import flash_attention``): re-exporting
the function here would shadow the submodule of the same name.
"""
