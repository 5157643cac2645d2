"""The ways into the user's own training: `vlmdoctor.Doctor` (api.py), `vlmdoctor.DoctorCallback` (callback.py)
and `vlmdoctor run -- script` (launch.py, the parent; child.py, the bootstrap in the script's process), with the
launchers it follows into every rank (launchers.py, rank_entry.py) and the ranks' numbers joined into rank 0's
report (rank_join.py).

All three measure through one `Recorder` (recorder.py), made of parts with one job each: the tokens of the
step under way (tokens.py), the step clock and its timed window (clock.py), the traced window and its
profiler (traced.py, with one_profiler.py: one torch.profiler session per process), the report of what was
measured (report.py), and what becomes of a finished report: diagnosed, written, printed (outputs.py).
"""
