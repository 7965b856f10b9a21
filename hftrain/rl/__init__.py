"""Online reinforcement learning (objective `grpo`): the loss over fixed rollouts (`rl.loss`), reward functions
(`rl.rewards`). The objective's builder (objectives) wires them into the one loop."""
