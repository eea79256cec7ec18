"""The runtime inside a training process: ``tmrun.init()`` (:mod:`.runtime`, the facade), the
worker's role (:mod:`.roles`), ``steps()`` (:mod:`.loop`), recovery and healing
(:mod:`.recovery`), planned migration (:mod:`.migration`), the standby's sandbox (:mod:`.standby`),
the optimizer guard (:mod:`.optimizer`), what moves (:mod:`.tracked`, :mod:`.transfer`)."""
