"""`python -m unbroken.engine.cuda`: build the stand-in CUDA libraries and print where."""

from unbroken.engine.cuda import build

print(build())
