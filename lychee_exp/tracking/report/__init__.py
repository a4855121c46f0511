"""The local HTML report over run and sweep directories: data (reading runs), plots, html (the page and its CLI),
output (where the page goes). May import: tracking and below."""
