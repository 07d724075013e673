"""The solver half: a chain's ``Costs``, the ops and ``simulate`` (what a
schedule costs), ``solve`` (the optimal schedule for a budget, in C through
``binding``) and the ``Plan`` the runtime reads."""
