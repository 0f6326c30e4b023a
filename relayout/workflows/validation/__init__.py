"""``relayout validate``: does the replay model hold on this disk? Predicted S against measured S.

The package owns the whole command: its options (:mod:`.options`), the preparation of the
containers it measures (:mod:`.prepare`), the measured run (:mod:`.run`), the diagnoses that bring
each run to the model's conditions (:mod:`.diagnoses`), the judging rules (:mod:`.rules`), the
typed ``validation.json`` record (:mod:`.record`), the verdict and its counts (:mod:`.summary`),
the verdict's text (:mod:`.summary_text`) and the predicted-vs-measured plot (:mod:`.plot`).
The method, the verdict's rules and their reasons are written out in ``docs/VALIDATION.md``.
"""
