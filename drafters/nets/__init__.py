"""The networks of trained drafters and their checkpoint format, shared by serving and training.

Serving drafters (`specserve.drafters.<name>`) build their networks from here and never import
`specserve.drafters.train`; the trainers (`specserve.drafters.train.<name>`) import these
networks to train them. One module per network: `eagle` (EagleHead), `medusa` (MedusaHeads),
`parallelspec` (ParallelSpecModule), `student` (StudentModel), plus `checkpoint` (the folder
format, the target fingerprint, shipped checkpoints) and `tree_tuning` (tree shapes from measured
acceptance). A new trained drafter adds its own file.
"""
