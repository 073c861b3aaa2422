"""The learner's state outside its steps (nodes/learner.py): what a checkpoint saves and a resumed
or restarted learner loads (one rank's, or with dp x tp ranks the whole state gathered onto rank 0,
in the one-rank format, and spread over the ranks again at the start of run()), and the final
weights saved at the end of the run (learner.save_final; with LoRA, merged and the adapter alone).
"""

from __future__ import annotations

from pathlib import Path

from rl.data import policy
from rl.model import lora
from rl.model.causal_lm import save_policy
from rl.model.precision import prepare_trained


class LearnerState:
    """Mixed into nodes/impl/learner.Learner (before RankCommands), whose setup sets the attributes used
    here: config, ctx, model, tokenizer, optimizer, peft, kl_ctl, rng, version, ranks, _saved and
    _pending_state; _all and _stop_followers are RankCommands'."""

    def state_dict(self) -> dict:
        if self.ranks is None:
            model = lora.trainable_state(self.model) if self.peft else self.model.state_dict()
            return {"step": self.version, "model": model, "optimizer": self.optimizer.state_dict(),
                    "kl": self.kl_ctl.state_dict(), "rng": self.rng.getstate()}
        # dp x tp: rank 0 saves the whole state (the one-rank format, so any layout can resume
        # from it), gathered by every rank in prepare_checkpoint.
        if not self.ranks.lead:
            return {"step": self.version}
        (model, optimizer), self._saved = self._saved, None
        return {"step": self.version, "model": model, "optimizer": optimizer, "kl": self.kl_ctl.state_dict(),
                "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        if self.ranks is not None:  # spread over the ranks at the start of run() (a collective)
            self.version = state["step"]
            if self.ranks.lead:
                self._pending_state = (state["model"], state["optimizer"])
                self.kl_ctl.load_state_dict(state["kl"])
                self.rng.setstate(state["rng"])
            return
        if self.peft:
            lora.load_trainable(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl"])
        self.rng.setstate(state["rng"])
        self.version = state["step"]

    async def prepare_checkpoint(self) -> None:
        """dp x tp: the whole state onto rank 0 (a collective: at a save_interval checkpoint or
        on Ctrl-C, whenever rank 0's loop is between commands)."""
        if self.ranks is not None and self.ranks.lead:
            self._saved = await self._all("gather", optimizer=True)

    async def _finish(self, ended: bool) -> None:
        """Save the final weights (one rank: also after a failure; dp x tp: gathered, so only after
        a normal end, when the other ranks still follow) and release the other ranks."""
        c = self.config
        if c.save_final and self.version > 0 and (self.ranks is None or ended):
            model = self.model
            if self.ranks is not None:          # a plain copy with the gathered weights
                weights, _ = await self._all("gather", optimizer=False)
                model, _ = policy.load(c.policy)
                prepare_trained(model, "cpu", c.precision).load_state_dict(weights)
            if self.peft:                       # merged into a fresh float32 base, and the adapter
                merged, adapter = lora.save_outputs(self.peft, self.tokenizer, policy.load(c.policy)[0].float(),
                                                    self.ctx.run_dir)
                self.ctx.artifact("final weights (LoRA merged)", merged)
                self.ctx.artifact("final LoRA adapter (peft)", adapter)
            else:
                path = Path(self.ctx.run_dir) / "final"
                save_policy(model, self.tokenizer, str(path))
                self.ctx.artifact("final weights", str(path))
        if ended:
            await self._stop_followers()
