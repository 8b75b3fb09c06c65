"""What the kernels run on rather than what they compute: the kernel switches (``switches``), Triton autotuning
pinned per GPU (``autotune``, ``autotune_pins/``) and kernels compiled ahead from a recorded manifest
(``compile_ahead``, ``compile_manifest/``)."""
