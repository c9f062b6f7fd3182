# Run by every Python context of hutch's code interpreter before its first
# execution (IPKernelApp.exec_files): adds the `e2b/data` display format,
# which the E2B SDK shows as `Result.data`, for pandas DataFrames (their
# columns as lists, JSON-safe: NaN as null, times in ISO 8601).


def _hutch_setup():
    import json
    import sys

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFrameFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj):
            # Only a loaded pandas can have made a DataFrame: nothing is
            # imported for other results.
            pandas = sys.modules.get("pandas")
            if pandas is not None and isinstance(obj, pandas.DataFrame):
                try:
                    return {
                        str(column): json.loads(obj[column].to_json(orient="values", date_format="iso"))
                        for column in obj.columns
                    }
                except Exception:
                    return None
            return super().__call__(obj)

    shell = get_ipython()
    if shell is not None:
        formatters = shell.display_formatter.formatters
        formatters["e2b/data"] = DataFrameFormatter(parent=shell.display_formatter)


_hutch_setup()
del _hutch_setup
