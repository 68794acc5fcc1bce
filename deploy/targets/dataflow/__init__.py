"""The dataflow target: prepare on Google Cloud Dataflow, and with `extract: beam` the
extraction on Dataflow's GPU or TPU workers too.

  plan.py    the `actx prepare` command line with Beam's PipelineOptions; also the prepare
             step that the other targets' plans run (in-process Beam without Dataflow)
  stage.py   the staging copy of actx that Dataflow's workers install (--setup_file)
  target.py  the Target: prepare on Dataflow, Beam extraction (deploy/targets/beam.py)
"""
