# IPython kernel settings of hutch's code interpreter (--config of every
# Python context's kernel).
c = get_config()  # noqa: F821
c.IPKernelApp.exec_files = ["/opt/hutch/interp/startup.py"]
# Tracebacks and reprs as plain text.
c.InteractiveShell.colors = "nocolor"
# Results are shown whole, as E2B's are.
c.PlainTextFormatter.max_seq_length = 0
