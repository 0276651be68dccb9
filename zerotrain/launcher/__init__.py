"""``deepspeed.launcher``: the ``deepspeed`` launcher's command line, run by ``zerotrain run``
(:mod:`zerotrain.launcher.runner`)."""
