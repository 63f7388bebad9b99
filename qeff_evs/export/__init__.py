"""torch -> ONNX for the graphs of the pipeline, the checks every exported graph passes, the export folder.

``vision`` and ``language`` trace the modules ``qeff_evs.models`` defines (the torch backend runs the
same modules); ``onnx_graph`` holds the export call and graph checks; ``pipeline`` writes an export
folder; ``compile`` turns one into ``qaic-compile`` runs. Exports use the legacy TorchScript exporter at
opset 17, the path QEfficient uses. Serving never imports this package.
"""
