"""The local HTML report over run and sweep directories: data (reading runs), plots, html (the page and its CLI).
May import: lychee_exp, lychee_exp.tracking."""
