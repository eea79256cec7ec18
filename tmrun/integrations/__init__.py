"""Integrations of third-party trainers with the worker API: each module adapts one framework's
own extension points (a trainer subclass, a config module) so that its users get in-place
replacement without editing the framework. They use only the public ``tmrun`` API
(``tmrun.init()`` and the runtime it returns) and are imported only by a user's configuration,
never by tmrun itself (:mod:`.torchtitan`: torchtitan's ``--module``)."""
