"""actx pipeline: `actx prepare`'s Beam pipeline (`pipeline.main`) and the checks its
inputs get before any work (`pipeline.preflight`, which imports no Beam).

Importing the package imports nothing else; a module that uses Beam imports
`pipeline.quiet_beam` first (Beam's first import without its apitools notice).
"""
