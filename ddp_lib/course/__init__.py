"""The course's tooling: the tutorial runner, learner copies, diagrams, committed results, the GPU check, the demo."""
