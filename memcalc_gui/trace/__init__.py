"""memcalc_gui.trace"""
