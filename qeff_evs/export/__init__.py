"""torch -> ONNX for the two graphs of the pipeline.

``attention`` holds the block-diagonal attention that lets one vision graph serve every grid;
``vision`` exports a family's vision(+EVS) wrapper to a single ONNX file with named dynamic axes.
Exports use the legacy TorchScript exporter at opset 17, the path QEfficient uses.
"""
