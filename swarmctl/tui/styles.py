"""The look of ``swarmctl top`` (Textual CSS).

Kept in a Python module rather than a .tcss file beside the app: the package's build
configuration ships Python files only, so a stylesheet file would be missing from a
``pip install .`` and the app would not start.
"""

# Summary and banner lines, the nodes table, the occupancy chart, then requests beside the rate.
CSS = """
#summary {
    height: 1;
    padding: 0 1;
    background: $boost;
}

#banner {
    display: none;
    height: 1;
    padding: 0 1;
    background: $warning 30%;
}

#banner.-visible {
    display: block;
}

#banner.-error {
    background: $error;
    color: $text;
    text-style: bold;
}

#panels.-stale {
    opacity: 55%;
}

#nodes, #chart, #requests, #rate, #plan {
    border: round $primary 60%;
    border-title-color: $text;
    border-subtitle-color: $text-muted;
}

#nodes {
    height: auto;
    max-height: 16;
    padding: 0 1;
}

#chart {
    height: auto;
    padding: 0 1;
}

#bottom {
    height: 1fr;
}

#requests {
    width: 60;  /* its columns with a DRAFT cell of 11 ("312/420 74%"), two borders and padding */
    height: 100%;
    padding: 0 1;
}

#side {
    width: 1fr;
    height: 100%;
}

#rate {
    height: 10;
    padding: 0 1;
}

#plan {
    height: 1fr;
    padding: 0 1;
}

HelpScreen {
    align: center middle;
}

#help {
    width: 90;
    height: 37;  /* every line of the help in view on a 40-line screen (DRAFT made it one longer) */
    border: round $accent;
    background: $surface;
    padding: 0 1;
}
"""
