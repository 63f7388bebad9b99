"""Sessions behind one interface: ``base`` (protocols, the retained-state session base), ``ort``, ``torch_reference``, ``qaic``."""
