"""memcalc_gui.ui"""
