"""FlatBuffers code generated from fbs/*.fbs by `make fbs` (fbs/generate.py).

Do not edit: change the schemas and regenerate. Only sbp.messages and its
private helpers may import these modules.
"""
